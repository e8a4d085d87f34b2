"""A multirun plan (argv[1]), then leave_job: no thread of a process group may outlive it (a gloo worker that
lives into interpreter exit can abort the process)."""
import os
import sys
import threading

from sixfold.join import join_job, leave_job
from sixfold.multirun import JOB_TIMEOUT, run_plan

run_plan(sys.argv[1], join_job(JOB_TIMEOUT)[0])
leave_job()
native, python = len(os.listdir("/proc/self/task")), threading.active_count()
assert native == python, f"{native - python} native thread(s) left after leave_job"
print("threads OK", flush=True)
