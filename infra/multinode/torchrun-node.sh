#!/usr/bin/env bash
# One node's share of the PivotRL training stage under torchrun (run it on every node).
#
#   NODE_RANK=<0..nnodes-1> MASTER_ADDR=<host of node 0> infra/multinode/torchrun-node.sh <spec URL>
#
# <spec URL> is what `python infra/multinode/launch_train.py prepare --config ...` printed (it lives
# under the run's storage_root, the only thing the nodes share). nnodes, nproc_per_node and
# master_port come from the config's training section; storage credentials from the environment
# (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL_S3 or an instance profile).
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: NODE_RANK=<i> MASTER_ADDR=<node 0> $0 <spec URL>" >&2
  exit 2
fi
cd "$(dirname "$0")/../.."
exec "${VENV:-.venv}/bin/python" infra/multinode/launch_train.py node --spec "$1" --launcher torchrun
