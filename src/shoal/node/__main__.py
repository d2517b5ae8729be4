"""`python -m shoal.node`: the composition root. It wires the network front (shoal.cluster.front: TCP with
project tokens, HTTP metrics) into the node, so the node's own modules never import the layer above them."""

import sys

from shoal.cluster.front import serve_network
from shoal.node.daemon import main

sys.exit(main(network=serve_network))
