"""``python -m dsec.rl.worker STATE_DIR``: the worker process (started by start_worker)."""

import sys

from dsec.rl.worker.server import main

if len(sys.argv) != 2:
    sys.exit("usage: python -m dsec.rl.worker STATE_DIR (start it with "
             "dsec.rl.worker.start_worker)")
main(sys.argv[1])
