"""Models: the actor-critic modules a run trains, and the transformer policy with its
tensor-parallel plan."""
