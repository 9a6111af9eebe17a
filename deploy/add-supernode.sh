#!/usr/bin/env bash
# Make an EC (NIST P-384) key pair for one SuperNode and register its public key with the
# SuperLink (`flwr supernode register KEY.pub <federation>`, over the TLS connection in
# $FLWR_HOME/config.toml). Only registered keys may connect when the SuperLink runs with
# --enable-supernode-auth.
#   deploy/add-supernode.sh NAME [--no-register]
# Writes $FEDMASK_DEPLOY_DIR/keys/NAME (private, stays on the device) and NAME.pub.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need ssh-keygen flwr

name=${1:-}
[[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "usage: deploy/add-supernode.sh NAME [--no-register]  (NAME: letters, digits, . _ -)"
mkdir -p "$KEY_DIR"
key="$KEY_DIR/$name"
if [[ ! -f $key ]]; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedmask-$name" -f "$key"
    echo "key: $key (+ .pub)"
fi
if [[ ${2:-} != --no-register ]]; then
    if ! out=$(flwr supernode register "$key.pub" "$FEDMASK_FEDERATION" --name "$name" 2>&1); then
        if grep -q "already in use" <<<"$out"; then
            echo "$name: $key.pub is already registered"
            exit 0
        fi
        echo "$out" >&2
        die "could not register $key.pub (is the SuperLink up? deploy/start-superlink.sh)"
    fi
    echo "$out"
fi
