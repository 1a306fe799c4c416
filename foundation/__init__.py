"""Small shared pieces every room may import: the error tree and hashing."""

import os

#: libgomp's spin count (how long an idle OpenMP thread busy-waits before it sleeps), read once,
#: when torch loads its OpenMP runtime; every room that can reach torch imports this package
#: first. With all torch work on one team (``foundation.compute``) the default, 300,000 spins,
#: made a 512-token prefill 4.0x slower beside one CPU hog on a 2-core machine (team threads
#: busy-wait for a partner the hog has descheduled); 3000 spins kept the idle time within 2 %
#: of the default and cut the time beside the hog to 0.59x of the default's; 1000 spins cut it
#: to 0.50x but cost 28 % idle (medians of 5-8 interleaved runs, docs/benchmarks.md, "One
#: compute thread"). Waiting never changes a result's bits. An operator's own GOMP_SPINCOUNT wins.
GOMP_SPINCOUNT = "3000"
os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
