# The origin bucket the trainer publishes to, and the checks that keep rollout_regions, the generated
# regions.tf and the lifecycle days consistent with each other and with `deltarelay gc`.

locals {
  # gc keeps everything reachable from the last K snapshots; the oldest of those objects is at most
  # K * snapshot_every steps old. Expiring anything younger would pull objects out from under a
  # manifest (watchers would then wait forever on a missing object). One day of margin on top.
  retention_floor_days = ceil(var.gc_keep_snapshots * var.snapshot_every * var.max_step_interval_seconds / 86400) + 1

  # Regions the generated regions.tf can serve, and the instantiated ones, keyed by region.
  supported_regions = keys(local.region_modules)
  regional          = { for r, m in local.region_modules : r => m[0] if length(m) > 0 }

  url_scheme = "s3://"
}

module "origin" {
  source = "./modules/bucket"

  bucket_name                        = "${var.name_prefix}-origin-${var.origin_region}"
  run_prefix                         = var.run_prefix
  runs                               = var.runs
  delta_expiration_days              = var.delta_expiration_days
  record_expiration_days             = var.record_expiration_days
  snapshot_expiration_days           = var.snapshot_expiration_days
  regional_snapshot_expiration_days  = var.regional_snapshot_expiration_days
  run_expiration_days                = var.run_expiration_days
  noncurrent_version_expiration_days = var.noncurrent_version_expiration_days
  abort_incomplete_multipart_days    = var.abort_incomplete_multipart_days
}

# Fails the plan, before anything is created, when the inputs disagree.
resource "terraform_data" "config_guard" {
  input = var.rollout_regions

  lifecycle {
    precondition {
      condition     = alltrue([for r in var.rollout_regions : contains(local.supported_regions, r)])
      error_message = "Every rollout region needs a provider and module block in regions.tf; regenerate it with: python infra/gen_regions.py --write <regions...> (see infra/README.md)."
    }
    precondition {
      condition     = alltrue([for r in var.rollout_regions : contains(keys(var.rollout_principal_arns), r)])
      error_message = "rollout_principal_arns needs an entry for every region in rollout_regions."
    }
    precondition {
      condition     = !var.enable_crr || !var.crr_regional_snapshots || length(var.runs) > 0
      error_message = "CRR without snapshots (crr_regional_snapshots) replicates per run: list the runs in var.runs, or set crr_regional_snapshots = false."
    }
    precondition {
      condition     = !var.enable_crr || !var.crr_regional_snapshots || alltrue([for r in var.rollout_regions : length(lookup(var.materialiser_principal_arns, r, [])) > 0])
      error_message = "CRR without snapshots needs materialiser_principal_arns for every rollout region (each runs `deltarelay materialise`)."
    }
    precondition {
      condition     = var.enable_crr || length(var.relay_principal_arns) > 0
      error_message = "Relay mode (enable_crr = false) needs relay_principal_arns for the relay role."
    }
    precondition {
      condition     = alltrue([for d in [var.delta_expiration_days, var.record_expiration_days, var.snapshot_expiration_days, var.regional_snapshot_expiration_days, var.run_expiration_days] : d >= local.retention_floor_days])
      error_message = "Lifecycle expiry is shorter than what `deltarelay gc --keep-snapshots K` keeps (K * snapshot_every * max_step_interval_seconds, plus a day); raise the *_expiration_days."
    }
    precondition {
      condition     = alltrue([for d in [var.delta_expiration_days, var.record_expiration_days, var.snapshot_expiration_days, var.regional_snapshot_expiration_days] : d <= var.run_expiration_days])
      error_message = "Per-kind expiry days must not exceed run_expiration_days (S3 applies the shortest matching expiry)."
    }
  }
}
