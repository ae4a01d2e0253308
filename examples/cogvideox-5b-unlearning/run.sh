#!/bin/sh
vramplan estimate --spec job.yaml
vramplan estimate --spec job-offload.yaml
vramplan compare --spec job.yaml --strategy "offload frozen diffusion.offload_frozen=true"
