"""kvyard as a fleet: the cluster token its processes share (auth.py), and on a Ray cluster replicas as Ray
actors in placement groups, found, replaced and autoscaled by a controller."""
