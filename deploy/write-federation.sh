#!/usr/bin/env bash
# Write the SuperLink connection [superlink.$FEDMASK_FEDERATION] into $FLWR_HOME/config.toml
# (default ~/.flwr): address = the SuperLink, root-certificates = the absolute path of ca.crt.
# Other entries and the default connection are kept; a missing file is first created by
# `flwr config list` with Flower's defaults, so `flwr run .` alone still means the local
# simulation. Then `flwr run . $FEDMASK_FEDERATION` and
# `flwr supernode register KEY.pub $FEDMASK_FEDERATION` talk to this SuperLink over TLS.
#   deploy/write-federation.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need python flwr
[[ -f $CERT_DIR/ca.crt ]] || die "$CERT_DIR/ca.crt missing: run deploy/make-certs.sh first"

export FLWR_HOME="${FLWR_HOME:-$HOME/.flwr}"
[[ -f $FLWR_HOME/config.toml ]] || flwr config list >/dev/null
python - "$FEDMASK_FEDERATION" "$(superlink_address)" "$CERT_DIR/ca.crt" <<'PY'
import os, sys, tempfile
from pathlib import Path

import tomli
import tomli_w

name, address, ca = sys.argv[1], sys.argv[2], str(Path(sys.argv[3]).resolve())
path = Path(os.environ["FLWR_HOME"]).expanduser() / "config.toml"
path.parent.mkdir(parents=True, exist_ok=True)
config = tomli.loads(path.read_text()) if path.is_file() else {}
superlinks = config.setdefault("superlink", {})
superlinks[name] = {"address": address, "root-certificates": ca}
fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config.toml.")
with os.fdopen(fd, "wb") as f:
    tomli_w.dump(config, f)
os.replace(tmp, path)
print(f"[superlink.{name}] address = {address!r}, root-certificates = {ca!r} -> {path}")
PY
