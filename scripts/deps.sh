#!/usr/bin/env bash
# Installs the Debian packages brigade needs, only those missing (quick when all are present).
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libeigen3-dev libfmt-dev doctest-dev libbenchmark-dev
      libopenblas-dev libcli11-dev nlohmann-json3-dev fortunes
      libopenmpi-dev openmpi-bin coinor-libcbc-dev)
pkgs+=("$@")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "brigade: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
