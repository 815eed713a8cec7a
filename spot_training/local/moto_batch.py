"""moto 5.2.5's AWS Batch under CloudFormation, made to accept and delete the ``SpotSweep`` stack.

Applied inside the local moto server process (spot_training/local/moto_server.py), like
spot_training/local/cfn_compat.py. Two gaps, each closed here because moto has no option for it:

1. ``AWS::Batch::ComputeEnvironment`` with ``Type: managed`` (lower case, as aws-cdk-lib writes it and
   CloudFormation accepts) fails moto's check for ``MANAGED``; the patch upper-cases it. Without ``ServiceRole`` raises KeyError in moto; AWS uses the
   service-linked role ``AWSServiceRoleForBatch`` then (AWS Batch User Guide, "Using service-linked
   roles"), which aws-cdk-lib's ``ManagedEc2EcsComputeEnvironment`` relies on. The patch uses that
   role's ARN and creates the role in moto's IAM the first time, as AWS does.
2. ``Fn::GetAtt`` of ``ComputeEnvironmentArn`` (the job queue's order) fails: moto's models have no
   ``get_cfn_attribute``; the patch answers the ARN.
3. moto's Batch models have no ``delete``: ``cdk destroy`` left the compute environments, job
   queues and job definitions behind. The patch deletes (deregisters) them.
"""

from __future__ import annotations

from typing import Any

SERVICE_LINKED_ROLE = "AWSServiceRoleForBatch"


def apply() -> None:
    """Patch moto's Batch models (idempotent)."""
    from moto.batch import models
    from moto.iam.models import iam_backends

    if getattr(models.ComputeEnvironment, "_spot_training_batch", False):
        return
    original = models.ComputeEnvironment.create_from_cloudformation_json.__func__

    def create(cls: Any, resource_name: str, cloudformation_json: dict[str, Any], account_id: str, region_name: str,
               **kwargs: Any) -> Any:
        # CloudFormation accepts "managed" (aws-cdk-lib writes it so); moto's API accepts only "MANAGED".
        properties = {**cloudformation_json["Properties"], "Type": str(cloudformation_json["Properties"]["Type"]).upper()}
        cloudformation_json = {**cloudformation_json, "Properties": properties}
        if "ServiceRole" not in properties:
            iam = iam_backends[account_id]["global"]
            arn = f"arn:aws:iam::{account_id}:role/aws-service-role/batch.amazonaws.com/{SERVICE_LINKED_ROLE}"
            try:
                iam.get_role_by_arn(arn)
            except Exception:  # noqa: BLE001 - moto's IAMNotFoundException: create it, as AWS does on first use
                iam.create_role(role_name=SERVICE_LINKED_ROLE, assume_role_policy_document="{}",
                                path="/aws-service-role/batch.amazonaws.com/", permissions_boundary=None,
                                description="service-linked role", tags=[], max_session_duration="3600")
            cloudformation_json = {**cloudformation_json, "Properties": {**properties, "ServiceRole": arn}}
        return original(cls, resource_name, cloudformation_json, account_id, region_name, **kwargs)

    models.ComputeEnvironment.create_from_cloudformation_json = classmethod(create)  # type: ignore[method-assign]

    def backend(account_id: str, region_name: str) -> Any:
        return models.batch_backends[account_id][region_name]

    models.ComputeEnvironment.delete = lambda self, account_id, region_name: backend(account_id, region_name).delete_compute_environment(self.arn)  # type: ignore[attr-defined]
    models.JobQueue.delete = lambda self, account_id, region_name: backend(account_id, region_name).delete_job_queue(self.arn)  # type: ignore[attr-defined]
    models.JobDefinition.delete = lambda self, account_id, region_name: backend(account_id, region_name).deregister_job_definition(self.arn)  # type: ignore[attr-defined]
    # Fn::GetAtt: the job queue names its compute environments by ComputeEnvironmentArn.
    for model, attribute in ((models.ComputeEnvironment, "ComputeEnvironmentArn"), (models.JobQueue, "JobQueueArn"),
                             (models.JobDefinition, "JobDefinitionArn")):
        model.has_cfn_attr = classmethod(lambda cls, attr, _a=attribute: attr == _a)  # type: ignore[attr-defined]
        model.get_cfn_attribute = lambda self, attr: self.arn  # type: ignore[attr-defined]
    models.ComputeEnvironment._spot_training_batch = True  # type: ignore[attr-defined]
