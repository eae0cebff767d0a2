variable "bucket_name" {
  description = "Name of the bucket; also names its KMS alias."
  type        = string
}

variable "run_prefix" {
  description = "Key prefix under which deltarelay runs live (runs/<run>/manifest.json, deltas/, snapshots/, records/). Ends with '/'."
  type        = string
}

variable "runs" {
  description = "Run names that get per-kind expiry rules (deltas/, records/, snapshots/ under <run_prefix><run>/)."
  type        = list(string)
}

variable "delta_expiration_days" {
  description = "Days after which delta payloads (<run>/deltas/<step>-<part>.drd) of the listed runs expire."
  type        = number
}

variable "record_expiration_days" {
  description = "Days after which per-step records (<run>/records/<step>.json) of the listed runs expire."
  type        = number
}

variable "snapshot_expiration_days" {
  description = "Days after which snapshot shards (<run>/snapshots/<step>/...) of the listed runs expire."
  type        = number
}

variable "run_expiration_days" {
  description = "Days after which any object under run_prefix whose current version was not rewritten expires (abandoned runs)."
  type        = number
}

variable "noncurrent_version_expiration_days" {
  description = "Days a noncurrent version (an overwritten manifest, a gc-deleted object) is kept before it is removed."
  type        = number
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which incomplete multipart uploads (interrupted snapshot uploads) are aborted."
  type        = number
}

variable "regional_snapshot_expiration_days" {
  description = "Expiry of <run>/regional/snapshots/ objects (a region's own snapshots) of the listed runs."
  type        = number
}
