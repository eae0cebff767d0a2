variable "name_prefix" {
  description = "Prefix of every bucket, KMS alias and role name. Bucket names are global: make it unique to your account."
  type        = string
  default     = "deltarelay"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,30}[a-z0-9]$", var.name_prefix))
    error_message = "name_prefix must be 3-32 characters of lowercase letters, digits and '-' (it starts S3 bucket names)."
  }
}

variable "origin_region" {
  description = "Region of the trainer and of the origin bucket it publishes to."
  type        = string
  default     = "us-east-1"
}

variable "rollout_regions" {
  description = "Regions with rollout fleets. Each gets a bucket, a KMS key, a rollout role and (with enable_crr) a replication rule. Each must have a provider and module block in regions.tf (see README)."
  type        = list(string)
  default     = ["us-west-2", "eu-west-1", "ap-northeast-1"]

  validation {
    condition     = length(var.rollout_regions) > 0 && length(distinct(var.rollout_regions)) == length(var.rollout_regions)
    error_message = "rollout_regions must list at least one region, each once."
  }

  validation {
    condition     = alltrue([for r in var.rollout_regions : can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", r))])
    error_message = "rollout_regions entries must be AWS region names such as us-west-2."
  }
}

variable "run_prefix" {
  description = "Key prefix under which runs live, as in the store URL s3://<bucket>/<run_prefix><run>. Must match what the trainer, relay and watchers are given."
  type        = string
  default     = "runs/"

  validation {
    condition     = can(regex("^([A-Za-z0-9._-]+/)+$", var.run_prefix))
    error_message = "run_prefix must be one or more path segments ending with '/', such as runs/."
  }
}

variable "runs" {
  description = "Run names that get per-kind expiry rules under <run_prefix><run>/ (deltas/, records/, snapshots/). Runs not listed are still covered by run_expiration_days."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for r in var.runs : can(regex("^[A-Za-z0-9._-]+$", r))])
    error_message = "runs entries must be single path segments (no '/')."
  }
}

variable "gc_keep_snapshots" {
  description = "The K you run `deltarelay gc --keep-snapshots K` with. Sets, with snapshot_every and max_step_interval_seconds, the youngest safe expiry."
  type        = number
  default     = 3
}

variable "snapshot_every" {
  description = "The trainer's Publisher snapshot_every (steps between full snapshots)."
  type        = number
  default     = 25
}

variable "max_step_interval_seconds" {
  description = "Longest time between two published steps, pauses included, for a run you intend to keep serving."
  type        = number
  default     = 3600
}

variable "delta_expiration_days" {
  description = "Expiry of <run>/deltas/<step>-<part>.drd objects of the listed runs."
  type        = number
  default     = 14
}

variable "record_expiration_days" {
  description = "Expiry of <run>/records/<step>.json objects of the listed runs."
  type        = number
  default     = 14
}

variable "snapshot_expiration_days" {
  description = "Expiry of <run>/snapshots/<step>/ shards of the listed runs."
  type        = number
  default     = 21
}

variable "regional_snapshot_expiration_days" {
  description = "Expiry of <run>/regional/snapshots/ objects (each region's own snapshots) of the listed runs: a backstop for a materialiser that stopped; the materialiser deletes snapshots it drops itself."
  type        = number
  default     = 21
}

variable "run_expiration_days" {
  description = "Expiry of any object under run_prefix whose current version is older than this: abandoned runs, objects gc missed. Must be at least each per-kind expiry."
  type        = number
  default     = 30
}

variable "noncurrent_version_expiration_days" {
  description = "Days a noncurrent version (an overwritten manifest.json, an object deleted by gc) is kept for recovery."
  type        = number
  default     = 3

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be at least 1."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (interrupted snapshot shards) are aborted."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be at least 1."
  }
}

variable "enable_crr" {
  description = "true: S3 Cross-Region Replication with RTC copies the origin to every regional bucket (no relay process, no relay role). false: run `deltarelay relay` under the relay role."
  type        = bool
  default     = false
}

variable "crr_regional_snapshots" {
  description = "With enable_crr: replicate each listed run's manifest.json, records/ and deltas/ only (never snapshots/), and let a materialiser per region build that region's snapshots. Needs the runs in var.runs (S3 replication filters are plain prefixes). false: replicate everything under run_prefix."
  type        = bool
  default     = true
}

variable "materialiser_principal_arns" {
  description = "CRR mode: per rollout region, the principals allowed to assume that region's materialiser role (`deltarelay materialise`)."
  type        = map(list(string))
  default     = {}

  validation {
    condition     = alltrue([for arns in values(var.materialiser_principal_arns) : alltrue([for a in arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:", a))])])
    error_message = "materialiser_principal_arns values must be lists of IAM ARNs (no wildcards)."
  }
}

variable "trainer_principal_arns" {
  description = "Principals allowed to assume the trainer role (publish, rebase, gc on the origin)."
  type        = list(string)

  validation {
    condition     = length(var.trainer_principal_arns) > 0 && alltrue([for a in var.trainer_principal_arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:", a))])
    error_message = "trainer_principal_arns must be one or more IAM ARNs (no wildcards)."
  }
}

variable "relay_principal_arns" {
  description = "Principals allowed to assume the relay role (relay mode only; ignored with enable_crr)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for a in var.relay_principal_arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:", a))])
    error_message = "relay_principal_arns must be IAM ARNs (no wildcards)."
  }
}

variable "rollout_principal_arns" {
  description = "Per rollout region, the principals (the region's rollout hosts) allowed to assume that region's rollout role."
  type        = map(list(string))

  validation {
    condition     = alltrue([for arns in values(var.rollout_principal_arns) : length(arns) > 0 && alltrue([for a in arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:", a))])])
    error_message = "rollout_principal_arns values must be non-empty lists of IAM ARNs (no wildcards)."
  }
}

variable "tags" {
  description = "Tags applied to every resource through the providers' default_tags."
  type        = map(string)
  default     = { project = "deltarelay" }
}
