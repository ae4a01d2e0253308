#!/bin/sh
vramplan estimate --spec job.yaml
vramplan estimate --spec job.yaml --seq-len 131072 --attention eager --gradient-checkpointing full
vramplan estimate --spec job.yaml --seq-len 131072 --attention flash --gradient-checkpointing full
# At 128K the fp32 logits (131072 x 151936 vocabulary) dominate: a fused loss removes them.
vramplan estimate --spec job.yaml --seq-len 131072 --gradient-checkpointing full --loss-impl fused-linear-cross-entropy
vramplan fit --spec job.yaml --maximize seq_len --plot longest.html
