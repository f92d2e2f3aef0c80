"""Deployments rendered for other systems: NVIDIA Dynamo's `DynamoGraphDeployment` as YAML."""
