terraform {
  # 1.5: check-free preconditions on terraform_data and the for-expressions used here.
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}

# The origin region's provider; each rollout region's aliased provider lives in regions.tf.
provider "aws" {
  region = var.origin_region
  default_tags {
    tags = var.tags
  }
}
