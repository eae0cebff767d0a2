#!/usr/bin/env bash
# Static checks of infra/ for CI: regions.tf matches its generator, then checkov over every .tf
# with no failed check (justified skips are inline #checkov:skip comments) and no parsing error.
# Usage: scripts/infra_check.sh            (uses $CHECKOV, else .venv-checkov/bin/checkov, else PATH)
#        make infra-check                  (installs the pinned checkov into .venv-checkov first)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [[ -z "${CHECKOV:-}" ]]; then
  if [[ -x .venv-checkov/bin/checkov ]]; then CHECKOV=.venv-checkov/bin/checkov; else CHECKOV=checkov; fi
fi
command -v "$CHECKOV" >/dev/null || { echo "infra_check: checkov not found (run: make infra-check)" >&2; exit 2; }

"$PY" infra/gen_regions.py --check

# --skip-download: no calls to the Prisma Cloud API (CI has no account; results are the same).
out=$("$CHECKOV" --directory infra --framework terraform --quiet --compact --skip-download 2>&1) && rc=0 || rc=$?
echo "$out"
if [[ $rc -ne 0 ]]; then
  echo "infra_check: checkov reported failed checks (exit $rc)" >&2
  exit "$rc"
fi
if grep -q "Parsing errors" <<<"$out"; then
  echo "infra_check: checkov could not parse part of infra/" >&2
  exit 1
fi
if ! grep -Eq "Passed checks: [1-9]" <<<"$out"; then
  echo "infra_check: checkov evaluated nothing; is infra/ empty?" >&2
  exit 1
fi
echo "infra_check: ok"
