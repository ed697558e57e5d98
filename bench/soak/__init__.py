"""`make soak`: a bounded reliability drill against a real `gnosis-daemon run` (see __main__).

- ``__main__``: the command line, the daemon's settings, the run;
- ``daemon``: the daemon under test, and what /proc says about its processes;
- ``load``: the clients: what each sends, and how each answer is classified;
- ``faults``: the faults, one at a time, and the probe sessions asked across each;
- ``drill``: load, faults and process samples on one clock, and the measurements after;
- ``measures``: what a request, a fault and a process sample recorded;
- ``report``: the verdict, the report, and writing it between the soak markers.
"""
