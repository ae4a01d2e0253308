#!/bin/sh
vramplan compare --spec job.yaml --tiers     # every catalog GPU: what it takes to hold this job
vramplan fit --spec job.yaml                 # full fine-tuning: only with the optimizer on the CPU
vramplan fit --spec job.yaml --method qlora --maximize seq_len
