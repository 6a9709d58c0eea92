"""Q3, where the data comes from: tasks, rewards, environments and the environment service, tools, the agent
loop and the inference engine, episodes of lm runs, and the gymnasium rollout."""
