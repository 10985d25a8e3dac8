import runpy
import sys

import imgtrain.metrics.memory as memory

memory.PSS_INTERVAL_S = 1e9
memory.PSS_MIN_GAP_S = 1e9
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
