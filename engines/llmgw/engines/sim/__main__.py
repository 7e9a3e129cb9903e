"""``python -m llmgw.engines.sim --host H --port N --model NAME [options]``:
run a sim engine (see :func:`llmgw.engines.sim.serve.main`)."""

import sys

from llmgw.engines.sim.serve import main

if __name__ == "__main__":
    sys.exit(main())
