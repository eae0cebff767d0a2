# CRR mode (enable_crr = true): S3 copies the run objects from the origin to each regional bucket,
# with Replication Time Control (99.99% within 15 minutes) and its metrics. With crr_regional_snapshots
# (the default) only each listed run's manifest.json, records/ and deltas/ are replicated: never the
# trainer's snapshots/ (each region's materialiser builds its own under regional/, which is region-local
# and has no origin copy to replicate). S3 filters are literal prefixes, so there is one rule per
# region, run and replicated kind; without crr_regional_snapshots one rule per region covers run_prefix.
# No order between objects: a regional manifest may name objects that have not arrived yet, which
# watchers handle by waiting and retrying. Delete markers are not replicated: gc on the origin must
# not pull objects from a region whose watchers may still be catching up; regional lifecycle rules
# expire them instead.

# Trust as in the S3 replication guide: the S3 service only. Only principals of this account with
# iam:PassRole on this role can name it in a replication configuration, so no other bucket can use it.
data "aws_iam_policy_document" "replication_assume" {
  count = var.enable_crr ? 1 : 0

  statement {
    sid     = "S3Replicates"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "replication" {
  count              = var.enable_crr ? 1 : 0
  name               = "${var.name_prefix}-replication"
  description        = "S3 CRR from the deltarelay origin bucket to every rollout region"
  assume_role_policy = data.aws_iam_policy_document.replication_assume[0].json
}

data "aws_iam_policy_document" "replication" {
  count = var.enable_crr ? 1 : 0

  statement {
    sid       = "ReadReplicationConfig"
    effect    = "Allow"
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [module.origin.bucket_arn]
  }

  statement {
    sid       = "ReadSourceVersions"
    effect    = "Allow"
    actions   = ["s3:GetObjectVersionForReplication", "s3:GetObjectVersionAcl", "s3:GetObjectVersionTagging"]
    resources = [local.origin_run_objects]
  }

  statement {
    sid       = "WriteReplicas"
    effect    = "Allow"
    actions   = ["s3:ReplicateObject", "s3:ReplicateTags"]
    resources = local.regional_run_objects
  }

  statement {
    sid       = "DecryptSource"
    effect    = "Allow"
    actions   = ["kms:Decrypt"]
    resources = [module.origin.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.origin_region}.amazonaws.com"]
    }
  }

  # Encrypt per the S3 replication guide; GenerateDataKey for replicas under the destination's S3 Bucket Key.
  statement {
    sid       = "EncryptReplicas"
    effect    = "Allow"
    actions   = ["kms:Encrypt", "kms:GenerateDataKey"]
    resources = local.regional_kms_key_arns
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = local.regional_s3_services
    }
  }
}

resource "aws_iam_role_policy" "replication" {
  count  = var.enable_crr ? 1 : 0
  name   = "replicate-origin-to-regions"
  role   = aws_iam_role.replication[0].id
  policy = data.aws_iam_policy_document.replication[0].json
}

locals {
  # What a run replicates in CRR mode without snapshots (tests/test_crossregion.py CRR_REPLICATED).
  crr_replicated_kinds = ["manifest.json", "records/", "deltas/"]
  crr_rules = var.crr_regional_snapshots ? merge([
    for r, m in local.regional : {
      for pair in setproduct(var.runs, local.crr_replicated_kinds) : "${r}-${pair[0]}-${trimsuffix(pair[1], "/")}" => {
        region = m
        prefix = "${var.run_prefix}${pair[0]}/${pair[1]}"
      }
    }
    ]...) : {
    for r, m in local.regional : r => { region = m, prefix = var.run_prefix }
  }
}

resource "aws_s3_bucket_replication_configuration" "origin" {
  count  = var.enable_crr ? 1 : 0
  role   = aws_iam_role.replication[0].arn
  bucket = module.origin.bucket

  # Priorities only need to be distinct.
  dynamic "rule" {
    for_each = local.crr_rules
    content {
      id       = "to-${rule.key}"
      priority = index(keys(local.crr_rules), rule.key) + 1
      status   = "Enabled"

      filter {
        prefix = rule.value.prefix
      }

      delete_marker_replication {
        status = "Disabled"
      }

      source_selection_criteria {
        sse_kms_encrypted_objects {
          status = "Enabled"
        }
      }

      destination {
        bucket        = rule.value.region.versioned_bucket_arn
        storage_class = "STANDARD"

        encryption_configuration {
          replica_kms_key_id = rule.value.region.kms_key_arn
        }

        replication_time {
          status = "Enabled"
          time {
            minutes = 15
          }
        }

        metrics {
          status = "Enabled"
          event_threshold {
            minutes = 15
          }
        }
      }
    }
  }

  # S3 refuses a replication configuration on an unversioned source.
  depends_on = [module.origin]
}
