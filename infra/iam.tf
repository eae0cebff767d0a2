# Least-privilege roles for the two writers. Object keys follow the relay store layout under
# <run_prefix><run>/: manifest.json (the one mutable object, committed with a conditional PUT),
# deltas/, snapshots/, records/ (immutable, written before the manifest that names them).
# Rollout roles (read-only, one per region) live in modules/region.

locals {
  immutable_kinds = ["deltas", "snapshots", "records"]

  origin_run_objects    = "${module.origin.bucket_arn}/${var.run_prefix}*"
  origin_immutable_keys = [for k in local.immutable_kinds : "${module.origin.bucket_arn}/${var.run_prefix}*/${k}/*"]
  origin_manifest_keys  = "${module.origin.bucket_arn}/${var.run_prefix}*/manifest.json"

  regional_bucket_arns = [for r in local.regional : r.bucket_arn]
  regional_run_objects = [for r in local.regional : "${r.bucket_arn}/${var.run_prefix}*"]

  regional_immutable_keys = flatten([
    for r in local.regional : [for k in local.immutable_kinds : "${r.bucket_arn}/${var.run_prefix}*/${k}/*"]
  ])

  regional_manifest_keys = [for r in local.regional : "${r.bucket_arn}/${var.run_prefix}*/manifest.json"]
  # A region's own snapshots and their announcement (docs/PROTOCOL.md §8.1), written by the relay in
  # regional-snapshot mode (`deltarelay relay --regional-snapshots`) or by a materialiser (modules/region).
  regional_snapshot_keys = [for r in local.regional : "${r.bucket_arn}/${var.run_prefix}*/regional/snapshots/*"]
  regional_announce_keys = [for r in local.regional : "${r.bucket_arn}/${var.run_prefix}*/regional/snapshots.json"]
  regional_kms_key_arns  = [for r in local.regional : r.kms_key_arn]
  regional_s3_services   = [for r in keys(local.regional) : "s3.${r}.amazonaws.com"]
}

# ---------------------------------------------------------------------------------------------
# Trainer: `deltarelay publish`, `rebase` and `gc` against the origin; no access to regional buckets.

data "aws_iam_policy_document" "trainer_assume" {
  statement {
    sid     = "TrainerHostsAssume"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "AWS"
      identifiers = var.trainer_principal_arns
    }
  }
}

resource "aws_iam_role" "trainer" {
  name               = "${var.name_prefix}-trainer"
  description        = "deltarelay trainer: publish, rebase and gc runs in the origin bucket"
  assume_role_policy = data.aws_iam_policy_document.trainer_assume.json
}

data "aws_iam_policy_document" "trainer" {
  statement {
    sid       = "ListOriginRuns"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [module.origin.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}*"]
    }
  }

  statement {
    sid       = "ReadOriginRuns"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = [local.origin_run_objects]
  }

  # Immutable objects are created with If-None-Match: * too, but not required to be here: a
  # snapshot shard is a multipart upload, and CreateMultipartUpload/UploadPart (also s3:PutObject)
  # carry no such header, so the condition would refuse every large snapshot. ListParts
  # (s3:ListMultipartUploadParts) checks every part's stored size before the completion.
  statement {
    sid       = "WriteImmutableObjects"
    effect    = "Allow"
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = local.origin_immutable_keys
  }

  # `deltarelay gc` and `rebase` delete unreachable deltas, records and snapshots; never the manifest.
  statement {
    sid       = "CollectImmutableObjects"
    effect    = "Allow"
    actions   = ["s3:DeleteObject"]
    resources = local.origin_immutable_keys
  }

  # The manifest may only be written as a compare-and-swap (If-Match: <etag read>) ...
  statement {
    sid       = "CommitManifestIfMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = [local.origin_manifest_keys]
    condition {
      test     = "Null"
      variable = "s3:if-match"
      values   = ["false"]
    }
  }

  # ... or created once (If-None-Match: *), so two publishers can never fork a run.
  statement {
    sid       = "CreateManifestIfNoneMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = [local.origin_manifest_keys]
    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "UseOriginKey"
    effect    = "Allow"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [module.origin.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.origin_region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "trainer" {
  name   = "publish-to-origin"
  role   = aws_iam_role.trainer.id
  policy = data.aws_iam_policy_document.trainer.json
}

# ---------------------------------------------------------------------------------------------
# Relay (relay mode only): `deltarelay relay` reads the origin and writes every regional bucket
# (with --regional-snapshots also regional/: the regions' own snapshots and their announcements);
# it is the only writer of those buckets, so regional `deltarelay gc` runs under it too.

data "aws_iam_policy_document" "relay_assume" {
  count = var.enable_crr ? 0 : 1

  statement {
    sid     = "RelayHostsAssume"
    effect  = "Allow"
    actions = ["sts:AssumeRole"]
    principals {
      type        = "AWS"
      identifiers = var.relay_principal_arns
    }
  }
}

resource "aws_iam_role" "relay" {
  count              = var.enable_crr ? 0 : 1
  name               = "${var.name_prefix}-relay"
  description        = "deltarelay relay: read the origin bucket, write every regional bucket"
  assume_role_policy = data.aws_iam_policy_document.relay_assume[0].json
}

data "aws_iam_policy_document" "relay" {
  count = var.enable_crr ? 0 : 1

  statement {
    sid       = "ListOriginRuns"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = [module.origin.bucket_arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}*"]
    }
  }

  statement {
    sid       = "ReadOriginRuns"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = [local.origin_run_objects]
  }

  statement {
    sid       = "DecryptOrigin"
    effect    = "Allow"
    actions   = ["kms:Decrypt"]
    resources = [module.origin.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.origin_region}.amazonaws.com"]
    }
  }

  # The fleet ledger (docs/PROTOCOL.md §9): each region's host entries gathered into the origin's
  # fleet/regions/, the one origin prefix the relay writes (advisory: no reader loads weights by it).
  statement {
    sid       = "WriteOriginFleetRegions"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = ["${module.origin.bucket_arn}/${var.run_prefix}*/fleet/regions/*"]
  }

  statement {
    sid       = "EncryptOriginFleetRegions"
    effect    = "Allow"
    actions   = ["kms:GenerateDataKey"]
    resources = [module.origin.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.origin_region}.amazonaws.com"]
    }
  }

  statement {
    sid       = "ListRegionalRuns"
    effect    = "Allow"
    actions   = ["s3:ListBucket"]
    resources = local.regional_bucket_arns
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.run_prefix, "${var.run_prefix}*"]
    }
  }

  # Reading what a region already holds is how the relay resumes after a restart.
  statement {
    sid       = "ReadRegionalRuns"
    effect    = "Allow"
    actions   = ["s3:GetObject"]
    resources = local.regional_run_objects
  }

  statement {
    sid       = "WriteRegionalImmutableObjects"
    effect    = "Allow"
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = local.regional_immutable_keys
  }

  statement {
    sid       = "CollectRegionalImmutableObjects"
    effect    = "Allow"
    actions   = ["s3:DeleteObject"]
    resources = local.regional_immutable_keys
  }

  statement {
    sid       = "CommitRegionalManifestIfMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = local.regional_manifest_keys
    condition {
      test     = "Null"
      variable = "s3:if-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "CreateRegionalManifestIfNoneMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = local.regional_manifest_keys
    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["false"]
    }
  }

  # --regional-snapshots: the region's own snapshots (create-only, collected by the materialiser) ...
  statement {
    sid       = "WriteRegionalSnapshots"
    effect    = "Allow"
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]
    resources = local.regional_snapshot_keys
  }

  statement {
    sid       = "CollectRegionalSnapshots"
    effect    = "Allow"
    actions   = ["s3:DeleteObject"]
    resources = local.regional_snapshot_keys
  }

  # ... and their announcement, by compare-and-swap only.
  statement {
    sid       = "CommitRegionalAnnouncementIfMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = local.regional_announce_keys
    condition {
      test     = "Null"
      variable = "s3:if-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "CreateRegionalAnnouncementIfNoneMatch"
    effect    = "Allow"
    actions   = ["s3:PutObject"]
    resources = local.regional_announce_keys
    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["false"]
    }
  }

  statement {
    sid       = "UseRegionalKeys"
    effect    = "Allow"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = local.regional_kms_key_arns
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = local.regional_s3_services
    }
  }
}

resource "aws_iam_role_policy" "relay" {
  count  = var.enable_crr ? 0 : 1
  name   = "relay-origin-to-regions"
  role   = aws_iam_role.relay[0].id
  policy = data.aws_iam_policy_document.relay[0].json
}
