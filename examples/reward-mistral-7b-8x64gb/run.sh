#!/bin/sh
vramplan compare --spec job.yaml --strategies strategies.yaml
vramplan fit --spec job.yaml --top-k 3
