#!/bin/sh
# Where the memory goes, which strategy saves most, and the fastest layouts that fit.
vramplan estimate --spec job.yaml
vramplan compare --spec job.yaml
vramplan fit --spec job.yaml --top-k 3
