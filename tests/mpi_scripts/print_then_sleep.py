"""Prints a line on every rank, then sleeps: a job that runs past its timeout."""

import sys
import time

print("started, now sleeping", flush=True)
time.sleep(float(sys.argv[1]))
