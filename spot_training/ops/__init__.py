"""Operating a deployment on AWS (or on local mode's moto server): ``spot-train status|logs|cost`` (:mod:`.operations`)
and the interruption drill on a real account (:mod:`.aws_drill`). Standard library and boto3 only; nothing here
needs local mode's moto or the CDK."""
