#!/usr/bin/env bash
# Private recalibration (+recal) against the last iterate in cells of the calibration
# table, at the points the table selected (docs/calibration.md): one `fedsgld sweep` per
# cell, 3 seeds, --recal 0.15 (the calibration split comes out of the held-out records,
# so +recal trains on as many records). Writes OUT/<cell>/sweep.md.
# Usage: benchmarks/recal_cells.sh [OUT]
set -euo pipefail
OUT=${1:-runs/recal_cells}
cell() {  # NAME CONFIG EPSILON ARGS...
  local name=$1 cfg=$2 eps=$3; shift 3
  fedsgld sweep "simulations/$cfg.toml" --methods dpsgd dpsgld --set epsilon="$eps" \
    --recal 0.15 --no-progress --workers 2 --out "$OUT/$name" "$@"
}
cell mnist5k_eps1 sweep_mnist5k 1 --grid dpsgd.lr=0.25 --grid dpsgld.lr=0.5 --grid dpsgld.temperature=6
cell mnist5k_eps4 sweep_mnist5k 4 --grid dpsgd.lr=0.5 --grid dpsgld.lr=0.5 --grid dpsgld.temperature=1.1
cell mnist5k_eps0.5 sweep_mnist5k 0.5 --grid dpsgd.lr=0.25 --grid dpsgld.lr=0.25 --grid dpsgld.temperature=40
cell fmnist10k_eps1 sweep_fashion_mnist10k 1 --grid dpsgd.lr=0.5 --grid dpsgld.lr=0.5 --grid dpsgld.temperature=9
