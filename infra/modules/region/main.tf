# One rollout region: its bucket (same hardening and lifecycle as the origin) and the role its rollout
# hosts assume to run `deltarelay watch` against that bucket and nothing else: read-only, except each
# host's fleet ledger entry (fleet/hosts/, docs/PROTOCOL.md §9), which is advisory.

data "aws_region" "current" {}

module "store" {
  source = "../bucket"

  bucket_name                        = "${var.name_prefix}-${var.region}"
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

data "aws_iam_policy_document" "rollout_assume" {
  statement {
    sid     = "RolloutHostsAssume"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "AWS"
      identifiers = var.rollout_principal_arns
    }
  }
}

resource "aws_iam_role" "rollout" {
  name               = "${var.name_prefix}-rollout-${var.region}"
  description        = "deltarelay watchers in ${var.region}: read runs from this region's bucket only"
  assume_role_policy = data.aws_iam_policy_document.rollout_assume.json

  lifecycle {
    precondition {
      condition     = data.aws_region.current.name == var.region
      error_message = "modules/region for ${var.region} was given a provider for another region; fix the providers map in regions.tf."
    }
  }
}

data "aws_iam_policy_document" "rollout" {
  statement {
    sid       = "ListRuns"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [module.store.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}*"]
    }
  }

  statement {
    sid       = "ReadRunObjects"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*"]
  }

  # The fleet ledger: a watcher writes its own fleet/hosts/<host>.json (compare-and-swap); nobody loads
  # weights by it, so the worst a host can do with this is lie about the fleet (docs/SECURITY.md).
  statement {
    sid       = "WriteFleetLedger"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*/fleet/hosts/*"]
  }

  statement {
    sid       = "EncryptFleetLedger"
    effect    = "Allow"
    actions   = ["kms:GenerateDataKey"]
    resources = [module.store.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }

  statement {
    sid       = "DecryptWithRegionKey"
    effect    = "Allow"
    actions   = ["kms:Decrypt"]
    resources = [module.store.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "rollout" {
  name   = "read-${var.region}-runs"
  role   = aws_iam_role.rollout.id
  policy = data.aws_iam_policy_document.rollout.json
}

# ---------------------------------------------------------------------------------------------
# Materialiser (CRR mode): `deltarelay materialise` builds this region's own snapshots from the chain
# replication brings (docs/PROTOCOL.md §8.1). It reads the run here, reads the origin's snapshots/ only
# (its one bootstrap), and writes nothing but regional/ in this bucket: snapshot objects create-only,
# the announcement by compare-and-swap. In relay mode the relay role materialises instead.

data "aws_iam_policy_document" "materialiser_assume" {
  count = var.enable_crr ? 1 : 0

  statement {
    sid     = "MaterialiserHostsAssume"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "AWS"
      identifiers = var.materialiser_principal_arns
    }
  }
}

resource "aws_iam_role" "materialiser" {
  count              = var.enable_crr ? 1 : 0
  name               = "${var.name_prefix}-materialise-${var.region}"
  description        = "deltarelay materialiser in ${var.region}: read runs, write only regional/ in this region"
  assume_role_policy = data.aws_iam_policy_document.materialiser_assume[0].json

  lifecycle {
    precondition {
      condition     = length(var.materialiser_principal_arns) > 0
      error_message = "CRR mode needs materialiser_principal_arns for ${var.region} (who runs `deltarelay materialise` there)."
    }
  }
}

data "aws_iam_policy_document" "materialiser" {
  count = var.enable_crr ? 1 : 0

  statement {
    sid       = "ListRuns"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [module.store.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}*"]
    }
  }

  statement {
    sid       = "ReadRunObjects"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*"]
  }

  statement {
    sid       = "WriteRegionalSnapshots"
    effect    = "Allow"
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*/regional/snapshots/*"]
  }

  statement {
    sid       = "CollectRegionalSnapshots"
    effect    = "Allow"
    actions   = ["s3:DeleteObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*/regional/snapshots/*"]
  }

  statement {
    sid       = "CommitAnnouncementIfMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*/regional/snapshots.json"]
    condition {
      test     = "Null"
      variable = "s3:if-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "CreateAnnouncementIfNoneMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = ["${module.store.bucket_arn}/${var.run_prefix}*/regional/snapshots.json"]
    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "UseRegionKey"
    effect    = "Allow"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [module.store.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }

  # The bootstrap: one of the trainer's snapshots, read from the origin when the region has none.
  statement {
    sid       = "ReadOriginSnapshots"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = ["${var.origin_bucket_arn}/${var.run_prefix}*/snapshots/*"]
  }

  statement {
    sid       = "DecryptOrigin"
    effect    = "Allow"
    actions   = ["kms:Decrypt"]
    resources = [var.origin_kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.origin_region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "materialiser" {
  count  = var.enable_crr ? 1 : 0
  name   = "materialise-${var.region}"
  role   = aws_iam_role.materialiser[0].id
  policy = data.aws_iam_policy_document.materialiser[0].json
}
