"""The pipeline runtime: stage programs, schedules, the dispatch queue, transports, timelines."""
