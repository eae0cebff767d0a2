output "region" {
  description = "The rollout region."
  value       = var.region
}

output "bucket" {
  description = "Regional bucket name."
  value       = module.store.bucket
}

output "bucket_arn" {
  description = "Regional bucket ARN."
  value       = module.store.bucket_arn
}

output "kms_key_arn" {
  description = "ARN of the regional bucket's SSE-KMS key."
  value       = module.store.kms_key_arn
}

output "versioned_bucket_arn" {
  description = "Regional bucket ARN once versioning is on (replication destination)."
  value       = module.store.versioned_bucket_arn
}

output "rollout_role_arn" {
  description = "Role the region's watchers assume."
  value       = aws_iam_role.rollout.arn
}

output "materialiser_role_arn" {
  description = "Role `deltarelay materialise` assumes in this region (CRR mode); null in relay mode."
  value       = one(aws_iam_role.materialiser[*].arn)
}
