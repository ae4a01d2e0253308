#!/bin/sh
vramplan estimate --spec job.yaml
vramplan compare --spec job.yaml --plot compare.html
vramplan fit --spec job.yaml --maximize micro_batch_size
