"""``DistributedTrainingStack``: the parameter-server cluster stack (stack name ``DistributedTraining`` by default)."""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
import constructs
from aws_cdk import aws_ec2 as ec2

from .cluster import EFS_MOUNT_POINT, STATE_DIR, Framework, ParameterServerCluster
from .cluster_config import ClusterSettings
from .stack import SettingsStack, machine_image, new_vpc, node_subnets
from .tags import CLUSTER_MEMBER_TAG_KEY
from .userdata import SERVICE_NAME


class DistributedTrainingStack(SettingsStack):
    """A parameter-server training cluster with elastic spot workers (:class:`ParameterServerCluster`).

    Resources: a VPC (new: public subnets, no NAT gateway, flow logs; or an existing one by id) and
    the cluster: EFS for the dataset, checkpoints and cluster state; a coordinator/scheduler node and
    parameter servers in fixed-size on-demand Auto Scaling groups; workers on a Spot Fleet; one
    security group open only between members on the framework ports. Everything carries
    ``spot-training:stack=<stack name>``. The cluster agents create no EBS volumes or snapshots, so
    this stack has no data cleanup resource. ``cdk destroy`` deletes the file system (dataset,
    checkpoints, cluster state) unless the shared ``retain_data`` setting is true (then RETAIN), as
    the single-node stack does with its data volume.

    Outputs: ``FileSystemId``, ``AccessPointId``, ``WorkerFleetRequestId``, ``SchedulerGroupName``,
    ``ServerGroupName``, ``SecurityGroupId``, ``Logs``.

    Attributes:
        settings, vpc, cluster.
    """

    def __init__(
        self,
        scope: constructs.Construct,
        construct_id: str | None = None,
        *,
        settings: ClusterSettings | None = None,
        vpc: ec2.IVpc | None = None,
        vpc_subnets: ec2.SubnetSelection | None = None,
        **kwargs: Any,
    ) -> None:
        """Define the stack.

        Args:
            scope: the app.
            construct_id: default: ``settings.stack_name``.
            settings: validated settings; default: ``ClusterSettings()`` (every default).
            vpc: an ``ec2.IVpc`` of your own (then ``vpc_id``, ``vpc_flow_logs`` and ``private_subnets`` do
                not apply); default: a new VPC, or ``vpc_id`` looked up.
            vpc_subnets: where the nodes and mount targets go; default: the public subnets, or the
                isolated ones with ``private_subnets``.
            kwargs: passed to ``cdk.Stack`` (``env`` overrides ``settings.base.account``/``region``).

        Raises:
            ValueError: from the constructs, naming the bad prop; a ``vpc`` that is not an ``ec2.IVpc``.
        """
        settings = settings or ClusterSettings()
        base = settings.base
        super().__init__(
            scope, construct_id, stack_name=settings.stack_name, account=base.account, region=base.region,
            availability_zones=base.availability_zones,
            default_description=(f"Spot training: {settings.framework.value} parameter-server cluster, on-demand scheduler and servers, elastic spot workers, EFS"
                                 if settings.framework is not Framework.PYTORCH else
                                 "Spot training: pytorch cluster on TorchElastic, on-demand rendezvous coordinator, elastic spot workers, EFS"),
            **kwargs,
        )
        self.settings = settings
        if vpc is not None and not hasattr(vpc, "select_subnets"):
            raise ValueError(f"vpc must be an ec2.IVpc (ec2.Vpc(...) or ec2.Vpc.from_lookup(...)), got {type(vpc).__name__}")
        self.vpc = vpc if vpc is not None else new_vpc(self, base.vpc_id, flow_logs=base.vpc_flow_logs,
                                                       private_subnets=base.private_subnets)
        code = {"type": "git", "url": base.code_git_url, "ref": base.code_git_ref} if base.code_git_url else None
        self.monitoring = self.add_monitoring(base)
        self.cluster = ParameterServerCluster(
            self,
            "Cluster",
            vpc=self.vpc,
            vpc_subnets=vpc_subnets or node_subnets(base.private_subnets),
            machine_image=machine_image(base.image_id, base.ami_ssm_parameter),
            framework=settings.framework,
            num_servers=settings.num_servers,
            desired_workers=settings.workers,
            min_workers=settings.min_workers,
            max_workers=settings.max_workers,
            scheduler_instance_type=settings.scheduler_instance_type,
            server_instance_type=settings.server_instance_type,
            worker_instance_types=settings.worker_instance_types,
            ports=settings.ports,
            training_command=settings.training_command,
            # None for both: the defaults (Base AMI Python, framework builds per role).
            training_python=None if settings.training_requirements is None else settings.training_python,
            training_requirements=settings.training_requirements,
            training_user=base.training_user,
            training_inherit_site_packages=base.training_inherit_site_packages,
            code=code,
            allocation_strategy=base.allocation_strategy,
            max_price=base.max_price,
            root_volume_size_gib=base.root_volume_size_gib,
            imds_endpoint=base.imds_endpoint,
            stack_tag_value=self.stack_name,
            file_system_removal_policy=cdk.RemovalPolicy.RETAIN if base.retain_data else cdk.RemovalPolicy.DESTROY,
            torch_max_restarts=settings.torch_max_restarts,
            torch_shutdown_timeout_s=settings.torch_shutdown_timeout_s,
            torch_nproc_per_node=settings.torch_nproc_per_node,
            monitoring=self.monitoring.node_config(interval_s=base.monitoring_interval_s) if self.monitoring else None,
            notice_poll_interval_s=base.notice_poll_interval_s,
            checkpoint_every_steps=base.checkpoint_every_steps,
            checkpoint_every_seconds=base.checkpoint_every_seconds,
        )
        c = self.cluster
        if self.monitoring is not None:
            for role in (c.node_role, c.worker_role):
                self.monitoring.grant_publish(role.role)
            for nodes in (n for n in (c.worker_fleet.resource, c.scheduler_group, c.server_group) if n is not None):
                nodes.node.add_dependency(self.monitoring.log_group)
            self.monitoring.add_capacity_alarm(c.worker_fleet.fleet_request_id)
            cdk.CfnOutput(self, "Dashboard", value=self.monitoring.dashboard.dashboard_name,
                          description="CloudWatch dashboard of this training job")
        cdk.CfnOutput(self, "FileSystemId", value=c.file_system.file_system_id, description="EFS: datasets/, checkpoints/, logs/, cluster/")
        cdk.CfnOutput(self, "AccessPointId", value=c.file_system.access_point_id)
        cdk.CfnOutput(
            self,
            "WorkerFleetRequestId",
            value=c.worker_fleet.fleet_request_id,
            description=f"Workers' Spot Fleet; change its target capacity within {settings.min_workers}..{settings.max_workers} "
            f"(aws ec2 modify-spot-fleet-request), or remove a worker's {CLUSTER_MEMBER_TAG_KEY} tag to let it leave",
        )
        cdk.CfnOutput(self, "SchedulerGroupName", value=c.scheduler_group.auto_scaling_group_name)
        if c.server_group is not None:  # PyTorch clusters have no parameter servers
            cdk.CfnOutput(self, "ServerGroupName", value=c.server_group.auto_scaling_group_name)
        cdk.CfnOutput(self, "SecurityGroupId", value=c.security_group.security_group_id)
        cdk.CfnOutput(
            self,
            "Logs",
            value=(
                f"agent: journalctl -u {SERVICE_NAME} on a node (aws ssm start-session --target INSTANCE_ID); "
                f"trainer: {EFS_MOUNT_POINT}/logs on EFS; membership: {STATE_DIR}/plan.json and events.jsonl on EFS"
            ),
            description="Where the logs go",
        )
