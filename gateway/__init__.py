"""The asyncio shell of laps: HTTP (aiohttp), OpenAI schemas, tokenization, executing decisions, metrics."""
