output "mode" {
  description = "How objects reach the regions: \"crr\" (S3 replication) or \"relay\" (run `deltarelay relay`)."
  value       = var.enable_crr ? "crr" : "relay"
}

output "origin" {
  description = "Origin bucket: name, region, key, and the store URL prefix a run lives under (append the run name)."
  value = {
    bucket       = module.origin.bucket
    region       = var.origin_region
    kms_key_arn  = module.origin.kms_key_arn
    runs_url     = "${local.url_scheme}${module.origin.bucket}/${var.run_prefix}"
    endpoint_url = "https://s3.${var.origin_region}.amazonaws.com"
  }
}

output "regions" {
  description = "Per rollout region: bucket, key, rollout role, and the store URL prefix its watchers read."
  value = {
    for r, m in local.regional : r => {
      bucket           = m.bucket
      kms_key_arn      = m.kms_key_arn
      rollout_role_arn = m.rollout_role_arn
      # CRR mode: the role `deltarelay materialise` assumes there; null in relay mode
      materialiser_role_arn = m.materialiser_role_arn
      runs_url         = "${local.url_scheme}${m.bucket}/${var.run_prefix}"
      endpoint_url     = "https://s3.${r}.amazonaws.com"
    }
  }
}

output "trainer_role_arn" {
  description = "Role for `deltarelay publish`, `rebase` and `gc` on the origin."
  value       = aws_iam_role.trainer.arn
}

output "relay_role_arn" {
  description = "Role for `deltarelay relay` (relay mode); null with enable_crr."
  value       = one(aws_iam_role.relay[*].arn)
}

output "replication_role_arn" {
  description = "Role S3 replication assumes (CRR mode); null in relay mode."
  value       = one(aws_iam_role.replication[*].arn)
}
