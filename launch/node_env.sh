#!/usr/bin/env bash
# Run a command with MRL_NODE_IP set to this node's routable address (MRL_IFNAME's, see mrl_node_ip in
# launch/lib.sh):
#
#   launch/node_env.sh COMMAND [ARGS...]
#
# train.sbatch starts the trainer on every trainer node through this wrapper: each weight-sync sender binds
# its rendezvous store to, and advertises, its own node's address (sync.bind_host=auto reads MRL_NODE_IP),
# which one `srun --export` could not give, since the value differs per node. A value inherited from the batch
# environment is replaced for the same reason.
set -euo pipefail

MRL_PROG=node_env.sh
MRL_REPO=${MRL_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=launch/lib.sh
source "$MRL_REPO/launch/lib.sh"

(($#)) || mrl_die "usage: node_env.sh COMMAND [ARGS...]" 2
MRL_NODE_IP=$(mrl_node_ip)
export MRL_NODE_IP
exec "$@"
