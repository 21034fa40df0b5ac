"""Run-time of distributed training: process group, transport, block versions, policies, wait accounting."""
