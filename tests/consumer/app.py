"""A company CDK app that uses the library as a consumer would (run from this directory:
``python app.py OUTDIR``): its own ``infra`` package, its own VPC and bucket, two training jobs in
one stack and one in a second stack (the VPC and bucket in a third), and its own cdk-nag run. Writes ``OUTDIR/summary.json``: the
templates and every cdk-nag error with its construct path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import aws_cdk as cdk
import cdk_nag
from aws_cdk import aws_efs as efs
from aws_cdk import aws_s3 as s3

from infra import job_name, team_vpc  # the consumer's own package
from spot_training.infra import TrainingJob
from spot_training.infra.nag import acknowledge


def main(outdir: str) -> None:
    app = cdk.App(outdir=outdir)
    shared_stack = cdk.Stack(app, "TeamShared")  # the team's network and data, used by both training stacks
    vpc = team_vpc(shared_stack)
    datasets = s3.Bucket(shared_stack, "Datasets", enforce_ssl=True, block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
                         encryption=s3.BucketEncryption.S3_MANAGED)
    vision = cdk.Stack(app, "VisionTraining")
    shared = efs.FileSystem(vision, "Shared", vpc=vpc, encrypted=True)
    jobs = [TrainingJob(vision, "Resnet", vpc=vpc, job_id=job_name("vision", "resnet"),
                        training_command=["python", "train_resnet.py"]),
            TrainingJob(vision, "Vit", vpc=vpc, job_id=job_name("vision", "vit"), training_command=["python", "train_vit.py"],
                        instance_types=["g6.xlarge"])]
    language = cdk.Stack(app, "LanguageTraining")
    jobs.append(TrainingJob(language, "Bert", vpc=vpc, training_command=["python", "train_bert.py"], framework="pytorch"))
    for job in jobs:
        datasets.grant_read(job)
    for job in jobs[:2]:  # same stack as the file system
        shared.connections.allow_default_port_from(job)
    # Across stacks, the rule goes in the job's stack (CDK places a remote rule there; no cycle):
    jobs[2].connections.allow_to_default_port(shared)
    cdk.Aspects.of(app).add(cdk_nag.AwsSolutionsChecks())
    acknowledge(app)  # the library's reasons, attached to its own constructs
    assembly = app.synth()
    errors = []
    templates = {}
    for stack in (shared_stack, vision, language):
        artifact = assembly.get_stack_artifact(stack.artifact_id)
        templates[stack.stack_name] = str(Path(outdir) / artifact.template_file)
        for entry in artifact.find_metadata_by_type("aws:cdk:error"):
            errors.append({"path": entry.path, "message": str(entry.data)})
    summary = {"templates": templates, "nag_errors": errors, "job_paths": [j.node.path for j in jobs],
               "job_ids": [j.job_id for j in jobs]}
    (Path(outdir) / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
