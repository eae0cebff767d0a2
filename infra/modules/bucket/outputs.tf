output "bucket" {
  description = "Bucket name."
  value       = aws_s3_bucket.store.id
}

output "bucket_arn" {
  description = "Bucket ARN."
  value       = aws_s3_bucket.store.arn
}

output "region" {
  description = "Region the bucket lives in (from the provider the module was given)."
  value       = data.aws_region.current.name
}

output "kms_key_arn" {
  description = "ARN of the bucket's own SSE-KMS key."
  value       = aws_kms_key.store.arn
}

output "versioned_bucket_arn" {
  description = "Bucket ARN, known only once versioning is on: replication rules use it because S3 refuses to replicate to or from an unversioned bucket."
  value       = aws_s3_bucket.store.arn
  depends_on  = [aws_s3_bucket_versioning.store]
}
