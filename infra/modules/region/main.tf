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
