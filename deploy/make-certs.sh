#!/usr/bin/env bash
# Make a private CA and a TLS certificate for the SuperLink, valid for 127.0.0.1 and localhost
# (add names with FEDMASK_CERT_SANS="DNS:host.example,IP:10.0.0.5").
#   deploy/make-certs.sh [--force]
# Writes $FEDMASK_DEPLOY_DIR/certs/{ca.key,ca.crt,server.key,server.pem}. Existing files are kept
# unless --force is given (a new CA invalidates the ca.crt every SuperNode holds).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
need openssl

force=0
[[ ${1:-} == --force ]] && force=1
mkdir -p "$CERT_DIR"
if [[ -f $CERT_DIR/ca.crt && -f $CERT_DIR/server.pem && -f $CERT_DIR/server.key && $force == 0 ]]; then
    echo "certificates already in $CERT_DIR (deploy/make-certs.sh --force to make new ones)"
    exit 0
fi

sans="IP:127.0.0.1,DNS:localhost${FEDMASK_CERT_SANS:+,$FEDMASK_CERT_SANS}"
days="${FEDMASK_CERT_DAYS:-365}"
tmp=$(mktemp -d "$CERT_DIR/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

openssl req -x509 -newkey rsa:3072 -nodes -sha256 -days "$days" \
    -keyout "$tmp/ca.key" -out "$tmp/ca.crt" -subj "/CN=fedmask test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req -newkey rsa:3072 -nodes -sha256 -keyout "$tmp/server.key" -out "$tmp/server.csr" \
    -subj "/CN=${FEDMASK_SUPERLINK_HOST}" 2>/dev/null
cat >"$tmp/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$sans
EXT
openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
    -days "$days" -sha256 -extfile "$tmp/server.ext" -out "$tmp/server.pem" 2>/dev/null
openssl verify -CAfile "$tmp/ca.crt" "$tmp/server.pem" >/dev/null

chmod 600 "$tmp/ca.key" "$tmp/server.key"
for f in ca.key ca.crt server.key server.pem; do mv -f "$tmp/$f" "$CERT_DIR/$f"; done
echo "CA:     $CERT_DIR/ca.crt (give this to every SuperNode and to flwr)"
echo "server: $CERT_DIR/server.pem + server.key (SubjectAltName $sans)"
