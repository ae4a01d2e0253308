#!/bin/sh
vramplan compare --spec job.yaml --tiers     # every catalog GPU: what it takes to hold this job
vramplan fit --spec job.yaml                 # nothing in full fine-tuning: the closest and what would fit
vramplan fit --spec job.yaml --method qlora --maximize seq_len
