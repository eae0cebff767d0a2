# One deltarelay store bucket: KMS-encrypted, versioned, private, TLS-only, with lifecycle rules that
# follow the relay layout. Used for the origin and, through modules/region, for every rollout region.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  account_root = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
  # The immutable objects of one run, by kind: key infix under <run_prefix><run>/ and their expiry.
  run_object_kinds = {
    deltas    = var.delta_expiration_days
    records   = var.record_expiration_days
    snapshots = var.snapshot_expiration_days
  }
  # and a region's own snapshots (docs/PROTOCOL.md §8.1): a backstop for a materialiser that stopped,
  # expiring long after it drops them itself; regional/snapshots.json (the announcement) is never matched.
  per_run_rules = merge(merge([
    for run in var.runs : {
      for kind, days in local.run_object_kinds : "${run}-${kind}" => {
        prefix = "${var.run_prefix}${run}/${kind}/"
        days   = days
      }
    }
    ]...), {
    for run in var.runs : "${run}-regional-snapshots" => {
      prefix = "${var.run_prefix}${run}/regional/snapshots/"
      days   = var.regional_snapshot_expiration_days
    }
  })
}

resource "aws_kms_key" "store" {
  description             = "SSE-KMS key of deltarelay bucket ${var.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  # The standard account-root statement: lets IAM policies (the trainer, relay, rollout and
  # replication roles) grant use of this key; those policies name this key's ARN only.
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "EnableIamPolicies"
        Effect    = "Allow"
        Principal = { AWS = local.account_root }
        Action    = "kms:*"
        Resource  = "*"
      }
    ]
  })
}

resource "aws_kms_alias" "store" {
  name          = "alias/${var.bucket_name}"
  target_key_id = aws_kms_key.store.key_id
}

resource "aws_s3_bucket" "store" {
  #checkov:skip=CKV_AWS_18:Server access logs would need a second bucket per region; S3 data events in the account's CloudTrail are the audit trail.
  #checkov:skip=CKV_AWS_144:Replication is configured in the root module (replication.tf, var.enable_crr) from the origin to the regional buckets; regional buckets are its destinations.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: watchers poll manifest.json with conditional GETs by design.
  bucket        = var.bucket_name
  force_destroy = false
}

resource "aws_s3_bucket_ownership_controls" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "store" {
  bucket                  = aws_s3_bucket.store.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "store" {
  bucket = aws_s3_bucket.store.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "store" {
  bucket = aws_s3_bucket.store.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.store.arn
    }
    bucket_key_enabled = true
  }
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.store.arn,
      "${aws_s3_bucket.store.arn}/*",
    ]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOutdatedTls"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.store.arn,
      "${aws_s3_bucket.store.arn}/*",
    ]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "store" {
  bucket = aws_s3_bucket.store.id
  policy = data.aws_iam_policy_document.tls_only.json
  # S3 rejects policy writes racing the public access block on a new bucket.
  depends_on = [aws_s3_bucket_public_access_block.store]
}

resource "aws_s3_bucket_lifecycle_configuration" "store" {
  bucket = aws_s3_bucket.store.id

  # Backstop for every run, listed or not: objects whose current version is older than
  # run_expiration_days expire. An active run rewrites manifest.json every step and writes a
  # snapshot every snapshot_every steps, so only abandoned runs (and what gc missed) reach it.
  rule {
    id     = "expire-stale-run-objects"
    status = "Enabled"
    filter {
      prefix = var.run_prefix
    }
    expiration {
      days = var.run_expiration_days
    }
  }

  # Versioning keeps every overwritten manifest and every object gc deletes as a noncurrent
  # version: drop those after a few days, then the delete markers they leave behind.
  rule {
    id     = "clean-noncurrent-versions"
    status = "Enabled"
    filter {
      prefix = var.run_prefix
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_expiration_days
    }
    expiration {
      expired_object_delete_marker = true
    }
  }

  # Interrupted snapshot uploads (multipart) anywhere in the bucket: parts are billed until aborted.
  rule {
    id     = "abort-incomplete-uploads"
    status = "Enabled"
    filter {}
    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  # Per listed run, per object kind: <run_prefix><run>/deltas/, records/, snapshots/, regional/snapshots/.
  # manifest.json is never matched here: it is the run's only mutable object.
  dynamic "rule" {
    for_each = local.per_run_rules
    content {
      id     = "expire-${rule.key}"
      status = "Enabled"
      filter {
        prefix = rule.value.prefix
      }
      expiration {
        days = rule.value.days
      }
    }
  }

  # Lifecycle rules on a versioned bucket must follow versioning.
  depends_on = [aws_s3_bucket_versioning.store]
}
