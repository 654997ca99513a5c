"""Distributed training support: who this process is, and how long it waits for the others.

`ranks` finds a process's rank, local rank, world size and elastic attempt from any launcher
(environment or an initialized `torch.distributed` process group) and makes the ranks of one
job agree on one run id through the process group's store. `collectives` times the
collectives a rank calls (Python-level `torch.distributed` calls, DDP's gradient all-reduce)
so that the report and the live metrics can tell waiting for other ranks from own work.
"""
