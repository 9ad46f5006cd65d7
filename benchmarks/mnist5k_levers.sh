#!/usr/bin/env bash
# The calibration levers on MNIST-5k at epsilon 1 (4 sites, the calibration table's
# setting): clip norm at a fixed lr * clip (Bu et al. 2021), DP-SGLD's temperature and
# step-size decay, posterior thinning, private recalibration. Each lever is one
# `fedsgld sweep` over seeds 0 and 1; summarise with
#   python benchmarks/levers_summary.py runs/mnist5k_levers
# Usage: benchmarks/mnist5k_levers.sh [OUT]   (about 40 trials of 300 steps)
set -euo pipefail
OUT=${1:-runs/mnist5k_levers}
CFG=simulations/sweep_mnist5k.toml
run() {  # NAME METHOD ARGS...
  local name=$1 method=$2; shift 2
  fedsgld sweep "$CFG" --methods "$method" --seeds 0 1 --set epsilon=1 --no-progress \
    --workers 2 --out "$OUT/$name" "$@"
}
run sgd sgd --grid lr=0.5
run dpsgd_clip1 dpsgd --grid lr=0.25
run dpsgd_clip5 dpsgd --set clip=5 --grid lr=0.05
run dpsgd_clip20 dpsgd --set clip=20 --grid lr=0.0125
run dpsgld_t6 dpsgld --grid lr=0.5 --grid temperature=6
run dpsgld_t3 dpsgld --grid lr=0.5 --grid temperature=3
run dpsgld_clip5 dpsgld --set clip=5 --grid lr=0.1 --grid temperature=30
run dpsgld_const dpsgld --set decay_gamma=0 --grid lr=0.5 --grid temperature=6
run dpsgld_thin dpsgld --set burn_in=200 --set thin=2 --set max_samples=50 \
  --grid lr=0.5 --grid temperature=6
run dpsgd_clip5_lr0.25 dpsgd --set clip=5 --grid lr=0.25
run dpsgd_clip5_recal dpsgd --set clip=5 --grid lr=0.05 --recal 0.15
