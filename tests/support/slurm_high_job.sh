#!/bin/bash
# The high-priority job of the SLURM preemption tests: it only starts once the low partition's
# job has left the node, marks that it ran, and ends.
touch "${HIGH_MARK:?}"
sleep 1
