"""Local mode: the whole training lifecycle on one machine.

A moto server on loopback plays AWS (:mod:`spot_training.local.moto_server`, its gaps bridged by
:mod:`spot_training.local.moto_compat`), an instance-metadata emulator per node plays IMDS
(:mod:`spot_training.local.imds_emulator`), and each node is a local process running the same bootstrap agent
with the same config JSON the launch template carries. Nothing here is needed on AWS.
"""
