"""Imported last by the fork server (``tests/support/dist.py``): ``gc.freeze()`` on what it
preloaded.

A rank forked from the server inherits torch, transformers, accelerate, peft, pytest and the
ckptools core: ~370k objects the cyclic collector would walk in each full collection of each
rank. One such collection in a forked rank took 292 ms of CPU and wrote to ~25k inherited pages
(copy-on-write of the objects' headers: 100 MB copied); frozen, 0 ms and ~100 pages. Objects
the rank makes are collected as before.
"""

import gc

gc.freeze()
