variable "region" {
  description = "Rollout region this instance serves; must match the region of the provider passed in."
  type        = string
}

variable "name_prefix" {
  description = "Prefix of bucket, key alias and role names."
  type        = string
}

variable "run_prefix" {
  description = "Key prefix under which deltarelay runs live; ends with '/'."
  type        = string
}

variable "runs" {
  description = "Run names that get per-kind expiry rules."
  type        = list(string)
}

variable "delta_expiration_days" {
  description = "Expiry of <run>/deltas/ objects of the listed runs."
  type        = number
}

variable "record_expiration_days" {
  description = "Expiry of <run>/records/ objects of the listed runs."
  type        = number
}

variable "snapshot_expiration_days" {
  description = "Expiry of <run>/snapshots/ objects of the listed runs."
  type        = number
}

variable "run_expiration_days" {
  description = "Expiry of any object under run_prefix not rewritten for this long (abandoned runs)."
  type        = number
}

variable "noncurrent_version_expiration_days" {
  description = "Days noncurrent versions are kept."
  type        = number
}

variable "abort_incomplete_multipart_days" {
  description = "Days before incomplete multipart uploads are aborted."
  type        = number
}

variable "rollout_principal_arns" {
  description = "Principals (rollout hosts' roles or users) allowed to assume this region's rollout role."
  type        = list(string)

  validation {
    condition     = length(var.rollout_principal_arns) > 0
    error_message = "Each rollout region needs at least one principal ARN that may assume its rollout role."
  }
}

variable "regional_snapshot_expiration_days" {
  description = "Expiry of <run>/regional/snapshots/ objects of the listed runs."
  type        = number
}

variable "enable_crr" {
  description = "CRR mode: create this region's materialiser role."
  type        = bool
}

variable "materialiser_principal_arns" {
  description = "Principals allowed to assume this region's materialiser role (CRR mode)."
  type        = list(string)
}

variable "origin_bucket_arn" {
  description = "The origin bucket, whose snapshots/ the materialiser reads once to bootstrap."
  type        = string
}

variable "origin_kms_key_arn" {
  description = "The origin bucket's KMS key (decrypt only)."
  type        = string
}

variable "origin_region" {
  description = "Region of the origin bucket."
  type        = string
}
