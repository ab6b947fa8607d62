"""The engine core: request state, FCFS iteration-level scheduling, K/V bookkeeping, token-level
stop rules, and the loop that schedules, executes and updates one iteration at a time."""
