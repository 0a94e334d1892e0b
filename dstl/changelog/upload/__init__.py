"""Upload machinery: tasks, uploader, retries, schedulers (direct, batching) and the process service."""
