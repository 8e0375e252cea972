"""kvyard on a Ray cluster: replicas as Ray actors in placement groups, found and replaced by a controller."""
